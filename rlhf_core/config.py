"""Validated configuration: ``params.yaml`` is the single source of truth.

Every section is a pydantic model with ``extra="forbid"``, so an unknown key,
a wrong type or an out-of-range value fails with an error that names the key
path (``sft.lr: Input should be greater than 0``).  ``-S key.path=value``
overrides mirror ``dvc exp run -S``: the value is parsed as YAML.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_PARAMS = "params.yaml"


class ConfigError(ValueError):
    """A configuration problem; the message names the file and key path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- project
class ProjectConfig(_Section):
    name: str = Field("rlhf-demo", description="Project name; MLflow experiment and registry prefix default to it.")
    seed: int = Field(1234, ge=0, description="Global seed: data splits, init, sampling.")
    workspace: str = Field(".rlhf", description="Ignored state folder: MLflow DB, DVC remote, Prefect home.")


# --------------------------------------------------------------------------- data
class DemoDataConfig(_Section):
    n_rows: int = Field(6000, ge=10, description="Synthetic rows generated before the phase split.")
    max_operand: int = Field(20, ge=1, le=10_000, description="Operands are drawn from [0, max_operand].")
    ops: list[Literal["+", "-"]] = Field(default_factory=lambda: ["+", "-"], min_length=1,
                                         description="Arithmetic operators used by the demo task.")
    wrong_share: float = Field(0.3, ge=0.0, lt=1.0,
                               description="Share of SFT demonstrations that carry a wrong answer.")
    slip_share: float = Field(0.0, ge=0.0, le=1.0,
                              description="Share of questions whose every demonstration carries the same wrong "
                                          "answer (correct + 10) while their preference pairs prefer the correct "
                                          "answer (half of them over the slip, half over a neighbouring wrong "
                                          "answer): what imitation cannot learn and the reward model can teach.")


class ArithmeticDataConfig(_Section):
    """`data.source: arithmetic`: sums and differences in many phrasings for a pretrained chat model
    (`rlhf_core/rewards/arithmetic.py`; docs/data-card-arithmetic.md)."""

    n_train: int = Field(4000, ge=10, description="Training rows (questions with operand pairs and phrasings not "
                                                  "held out), split over SFT / RM / RL by `data_split`.")
    n_held_out: int = Field(400, ge=3, description="Held-out rows, split over the phases' eval files the same way.")
    max_operand: int = Field(99, ge=1, le=10_000, description="Operands are drawn from [0, max_operand].")
    ops: list[Literal["+", "-"]] = Field(default_factory=lambda: ["+", "-"], min_length=1,
                                         description="Operators asked.")
    held_out_pair_share: float = Field(0.15, ge=0.0, lt=1.0, description="Share of operand pairs held out.")
    held_out_phrasings: int = Field(2, ge=0, description="Phrasings per operator held out (the last ones listed).")
    base_negatives: int = Field(
        256, ge=0, description="Preference pairs whose rejected answer is the base model's own sampled wrong "
                               "answer (its final number in the answer style), sampled in prepare; the other "
                               "pairs reject a near miss. 0: near misses only (no sampling).")
    base_max_new_tokens: int = Field(24, ge=1, description="Tokens the base model may write per sampled answer.")


class ColumnMap(_Section):
    prompt: str = Field("prompt", description="Source column holding the prompt.")
    response: str = Field("response", description="Source column holding the SFT response.")
    chosen: str = Field("chosen", description="Source column holding the preferred response.")
    rejected: str = Field("rejected", description="Source column holding the dispreferred response.")
    messages: str = Field("messages", description="Source column holding a chat `messages` list.")
    answer: str = Field("answer", description="Source column holding a ground-truth answer (optional).")


class SourceConfig(_Section):
    """One data source: a local file or a Hugging Face dataset."""

    path: str | None = Field(None, description="Local JSONL/JSON/Parquet/CSV file.")
    hf_id: str | None = Field(None, description="Hugging Face dataset id or local dataset directory.")
    hf_split: str = Field("train", description="Split to load from `hf_id`.")
    hf_config: str | None = Field(None, description="Dataset configuration name for `hf_id`.")
    format: Literal["auto", "prompt_response", "pairwise", "prompt", "messages", "hh"] = Field(
        "auto", description="Row format; `auto` detects it from the columns present.")

    @model_validator(mode="after")
    def _one_location(self) -> SourceConfig:
        if (self.path is None) == (self.hf_id is None):
            raise ValueError("give exactly one of `path` or `hf_id`")
        return self


class PhaseFiles(_Section):
    sft: SourceConfig | None = None
    pairs: SourceConfig | None = None
    prompts: SourceConfig | None = None


class DataConfig(_Section):
    source: Literal["demo", "arithmetic", "mixed", "per_phase"] = Field(
        "demo", description="`demo`: built-in generator for the tiny model; `arithmetic`: real-text arithmetic "
                            "for a pretrained chat model (`data.arithmetic`, its held-out split); `mixed`: "
                            "`sources` split by `data_split`; `per_phase`: explicit `files` for each phase.")
    demo: DemoDataConfig = Field(default_factory=DemoDataConfig)
    arithmetic: ArithmeticDataConfig = Field(default_factory=ArithmeticDataConfig)
    sources: list[SourceConfig] = Field(default_factory=list, description="Sources for `source: mixed`.")
    files: PhaseFiles = Field(default_factory=PhaseFiles, description="Sources for `source: per_phase`.")
    columns: ColumnMap = Field(default_factory=ColumnMap)
    data_split: list[float] = Field(default_factory=lambda: [2.0, 4.0, 4.0], min_length=3, max_length=3,
                                    description="DeepSpeed-Chat shares for SFT / RM / RL (normalised).")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out share of every phase.")
    max_prompt_len: int = Field(48, ge=1, description="Prompt token limit (the text's tokens; a BOS that the "
                                                      "tokenizer adds comes on top).")
    max_response_len: int = Field(16, ge=1, description="Response token limit (longer rows are dropped).")
    truncation: Literal["left", "drop"] = Field(
        "left", description="Over-long prompts: keep their last tokens (`left`) or drop the row.")
    on_malformed: Literal["error", "drop"] = Field(
        "error", description="Malformed lines (bad JSON, non-UTF-8): fail naming file:line, or drop and count.")
    dedupe: bool = Field(True, description="Drop exact duplicate rows within a phase (counted).")

    @field_validator("data_split")
    @classmethod
    def _split_positive(cls, v: list[float]) -> list[float]:
        if any(x < 0 for x in v) or sum(v) <= 0:
            raise ValueError("shares must be >= 0 with a positive sum")
        return v


# --------------------------------------------------------------------------- model
class TinyModelConfig(_Section):
    """Llama-style config for the offline demo model (a few million parameters)."""

    vocab_size: int = Field(256, ge=32, description="Target vocab size of the locally trained tokenizer.")
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(352, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(4, ge=1)
    max_position_embeddings: int = Field(128, ge=16)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class ModelConfig(_Section):
    name_or_path: str | None = Field(
        None, description="The base model, imported by prepare into `models/base`: a Hub id, a local HF folder, "
                          "a `.gguf` file, or `pkg:<package>[/<file>.gguf]` (a GGUF an installed package ships); "
                          "null builds the tiny demo model offline.")
    tokenizer: str | None = Field(None, description="Tokenizer id or path (same forms); defaults to `name_or_path`.")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub (off by default).")
    chat_template: bool = Field(False, description="Render plain prompts with the tokenizer's chat template.")


# --------------------------------------------------------------------------- compute
class LoraConfig(_Section):
    enabled: bool = Field(False, description="Train LoRA adapters (peft) on the policy / RM backbone.")
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1, description="Module names that get adapters.")
    only_optimize_lora: bool = Field(True, description="Freeze everything but the adapters (and a value head).")
    merge_on_save: bool = Field(True, description="Merge adapters into the weights when saving the final model.")


class ComputeConfig(_Section):
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    offload: Literal["none", "cpu"] = Field(
        "none", description="ZeRO offload target: optimizer state (stage >= 1) and parameters (stage 3).")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="`auto`: bf16 on GPUs that support it, fp32 on CPU.")
    gradient_checkpointing: bool = False
    grad_clip: float = Field(1.0, gt=0.0)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    num_threads: int = Field(0, ge=0, description="torch CPU threads; 0: all cores split over local processes.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    stop_grace_s: float = Field(
        600.0, gt=0.0, description="After SIGTERM a training stage checkpoints at the next step boundary and "
                                   "exits 75; with no boundary within this many seconds it exits 143 (the previous "
                                   "checkpoint stands). Keep the pod's terminationGracePeriodSeconds above it.")


# --------------------------------------------------------------------------- stages
class OptimConfig(_Section):
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
    judge: bool = Field(
        False, description="Also train a judge reward model, same settings, on the held-out pairs (`eval_pairs`, "
                           "never seen by the proxy RM) into `models/judge`; its held-out accuracy is measured on "
                           "the proxy's training pairs. The evaluate stage's judge when prompts carry no answers "
                           "(`eval.judge: auto|model`). Off: `models/judge` holds only its meta file.")


class PPOConfig(_Section):
    clip_eps: float = Field(0.2, gt=0.0, description="PPO ratio clip: ratio is clamped to [1 - eps, 1 + eps].")
    value_clip_eps: float | None = Field(
        0.2, gt=0.0, description="Critic clip: V is kept within V_old +- eps in the clipped value loss; "
                                 "null: plain squared error.")
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual-clip constant c > 1 (Ye et al. 2020): caps the loss of negative "
                                  "advantages at -c * A; null: off.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount over response tokens.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    critic_lr: float = Field(5e-4, gt=0.0, description="Critic learning rate (same warmup/schedule as `rlhf.lr`).")
    vf_coef: float = Field(1.0, ge=0.0, description="Weight of the value loss.")
    kl_in: Literal["reward", "loss"] = Field(
        "reward", description="`reward`: -kl_coef * KL per token in the reward (InstructGPT); "
                              "`loss`: kl_coef * KL added to the policy loss.")
    advantage_estimator: Literal["gae", "rloo", "reinforce_pp"] = Field(
        "gae", description="`gae` trains a critic (from `models/rm`); `rloo` (needs samples_per_prompt >= 2) "
                           "and `reinforce_pp` are critic-free.")
    samples_per_prompt: int = Field(4, ge=1, description="Responses sampled per prompt (RLOO's group).")
    score_baseline: Literal["none", "group_mean"] = Field(
        "none", description="`group_mean`: subtract the mean score of the prompt's samples before the KL penalty "
                            "and GAE (needs samples_per_prompt >= 2). A pairwise (Bradley-Terry) RM's score is "
                            "defined only up to a per-prompt constant; centring removes it, so advantages carry "
                            "only what the RM can tell apart. (RLOO has its own leave-one-out baseline.)")


class GRPOConfig(_Section):
    group_size: int = Field(4, ge=2, description="G: responses sampled per prompt; advantages are group-relative.")
    beta: float = Field(0.04, ge=0.0, description="Coefficient of the KL (to the reference) term in the loss.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator in the loss (DeepSeekMath: k3).")
    clip_eps: float = Field(0.2, gt=0.0, description="Ratio clip of the GRPO surrogate.")
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO: centre only).")
    drop_uniform_groups: bool = Field(
        False, description="Drop the groups whose G scores are all equal (every advantage 0: only the KL term "
                           "would train on them) before the reference pass and training, counted as "
                           "`uniform_dropped` (DAPO's zero-variance filter, without re-sampling). The policy "
                           "gradient is then averaged over informative tokens only; `kl` and `reward_mean` "
                           "cover the trained rows, `score_mean` every sample.")


class RLHFConfig(OptimConfig):
    """PPO / GRPO. Optimiser keys (`lr`, `warmup_steps`, ...) count optimizer steps; `num_steps` counts rollout
    iterations and `max_steps` > 0 stops early (a later run resumes)."""

    algorithm: Literal["ppo", "grpo"] = Field("ppo", description="`ppo` (actor + critic) or `grpo` (no critic).")
    lr: float = Field(1e-4, gt=0.0, description="Actor learning rate.")
    warmup_steps: int = Field(0, ge=0, description="LR warmup in optimizer steps (an iteration makes "
                                                    "`ppo_epochs` x mini-batches of them).")
    micro_batch_size: int = Field(64, ge=1, description="Experience rows per forward/backward pass (per process).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step: a mini-batch is "
                                                 "micro_batch_size x grad_accum rows of the buffer per process.")
    save_every: int = Field(50, ge=0, description="Checkpoint every N iterations; 0: only at the end.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "constant", description="LR decay after the linear warmup (RL: constant).")
    log_every: int = Field(10, ge=1, description="Log metrics every N iterations (and the first and last).")
    max_steps: int = Field(0, ge=0, description="Stop after this many rollout iterations (0: `num_steps`); the "
                                                "schedule still spans `num_steps`, so a re-run resumes.")
    prompts_per_step: int = Field(64, ge=1, description="Prompts per rollout iteration over all processes "
                                                        "(must divide by the process count).")
    generation_batch_size: int = Field(
        0, ge=0, description="Prompts per generate call; the calls of one iteration fill the experience buffer "
                             "(DeepSpeed-Chat generation batches). 0: all of a process's prompts at once.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the experience buffer per iteration.")
    num_steps: int = Field(120, ge=1, description="Rollout/train iterations.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (log-probs use the same scaling).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    max_new_tokens: int = Field(8, ge=1, description="Response token limit during rollouts.")
    shared_prefix: bool = Field(
        True, description="Forward each prompt once for its group of samples (GRPO's G, PPO's "
                          "`samples_per_prompt`) in the log-prob passes, the critic's value pass and the actor's "
                          "and critic's training forward: the prompt's KV cache is shared by the group's "
                          "responses (same logits, values and gradients up to float rounding, fewer FLOPs; "
                          "docs/rlhf.md). Off under `compute.gradient_checkpointing`. RM scoring always computes "
                          "a shared prompt once (inference only).")
    pack_groups: bool = Field(
        True, description="With `shared_prefix`, the actor's and reference's log-prob passes and the actor's "
                          "training forward pack each group's responses after its prompt in one row under a "
                          "block-causal mask (`rlhf_core/group_packing.py`: no padding between responses, one "
                          "pass, no KV cache to index; same logits and gradients up to float rounding). Only "
                          "for models with `attn_implementation` sdpa whose every layer is full attention, and "
                          "packed rows of at most `group_packing.PACK_MAX_WIDTH` tokens; otherwise, and for the "
                          "critic, the prompt's KV cache is shared (docs/rlhf.md; timings: "
                          "docs/results/benchmarks-rl-speed.md, docs/results/benchmarks-gpu-passes.md).")
    rollout_logprobs: Literal["generation", "recompute"] = Field(
        "generation", description="Where the rollout policy's log-probs (PPO's old log-probs) come from: "
                                  "`generation` records them while sampling (no second forward pass; equal to the "
                                  "recomputed ones up to float rounding in fp32; docs/rlhf.md), `recompute` runs "
                                  "a forward pass over the finished sequences (TRL, OpenRLHF). Prefer `recompute` "
                                  "in bf16, where KV-cached and full forwards round differently.")
    kl_coef: float = Field(0.02, ge=0.0, description="PPO KL coefficient (initial value for `adaptive`).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="PPO KL estimator (k1, k2, k3).")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="PPO KL coefficient control.")
    kl_target: float = Field(6.0, gt=0.0, description="Adaptive controller: target KL (nats per sequence).")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive controller horizon (samples).")
    reward_clip: float | None = Field(5.0, gt=0.0, description="PPO: scores are clamped to [-clip, clip] in the "
                                                                "token rewards; null: off. (GRPO normalises "
                                                                "scores within groups instead.)")
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages over the experience buffer.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight in the actor loss.")
    ptx_coef: float = Field(0.5, ge=0.0, description="Weight of an SFT (pretraining-mix) loss on sft.parquet.")
    ptx_batch_size: int = Field(0, ge=0, description="SFT rows of the ptx loss beside each RL micro-batch; 0: "
                                                    "`micro_batch_size`. A ptx row (prompt and answer) costs "
                                                    "several response-only rows of a shared-prefix RL batch.")
    ptx_min_reward: float | None = Field(
        None, description="Drop the ptx rows (prompt, demonstration) whose reward-model score (an ensemble's mean "
                          "standardised score) is below this before training, so the ptx loss does not teach what "
                          "the RM ranks low (wrong demonstrations); the rows kept and dropped are logged "
                          "(`ptx_rows`, `ptx_rows_dropped`). Needs `rm` in `reward_fns` (weight 0: the RM only "
                          "filters). One RM pass over sft.parquet at start. null: keep every row (docs/rlhf.md).")
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0,
                                    description="EMA of the actor weights, saved to models/actor_ema; null: off.")
    no_eos_penalty: float | None = Field(None, description="Score assigned to responses without EOS; null: keep.")
    reward_fns: dict[str, float] = Field(default_factory=lambda: {"exact_answer": 1.0},
                                         description="Reward sources by name with weights; `rm` is the RM.")
    rm_tokenizer_mismatch: Literal["retokenize", "error"] = Field(
        "retokenize", description="RM tokenizer differs from the actor's: score re-tokenised text, or fail.")
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)

    @property
    def samples_per_prompt(self) -> int:
        return self.grpo.group_size if self.algorithm == "grpo" else self.ppo.samples_per_prompt

    @model_validator(mode="after")
    def _groups_fit(self) -> RLHFConfig:
        if self.algorithm == "ppo" and self.ppo.score_baseline != "none" and self.ppo.samples_per_prompt < 2:
            raise ValueError(f"ppo.score_baseline: {self.ppo.score_baseline} needs ppo.samples_per_prompt >= 2 "
                             f"(got {self.ppo.samples_per_prompt})")
        if self.algorithm == "ppo" and self.ppo.advantage_estimator == "rloo" and self.ppo.samples_per_prompt < 2:
            raise ValueError("ppo.advantage_estimator: rloo needs ppo.samples_per_prompt >= 2 "
                             f"(got {self.ppo.samples_per_prompt})")
        k1 = ("k1 = logp - ref_logp has zero expected gradient as a loss term (E_pi[grad log pi] = 0), so it does "
              "not pull toward the reference; use k2 or k3")
        if self.algorithm == "grpo" and self.grpo.beta > 0 and self.grpo.kl_estimator == "k1":
            raise ValueError(f"grpo.kl_estimator: k1 with grpo.beta > 0 puts KL in the loss, but {k1}")
        if self.algorithm == "ppo" and self.ppo.kl_in == "loss" and self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError(f"kl_estimator: k1 with ppo.kl_in: loss, but {k1} (k1 is right in the reward)")
        if self.ptx_min_reward is not None and (self.ptx_coef == 0 or "rm" not in self.reward_fns):
            raise ValueError("ptx_min_reward filters the ptx rows by the reward model's score: it needs "
                             f"ptx_coef > 0 (got {self.ptx_coef}) and `rm` in reward_fns (got "
                             f"{sorted(self.reward_fns)}; `rm: 0.0` uses the RM only as the filter)")
        if self.algorithm == "grpo":
            rows = self.micro_batch_size * self.grad_accum
            if rows % self.grpo.group_size:
                raise ValueError(
                    f"grpo.group_size {self.grpo.group_size} does not divide the training batch "
                    f"micro_batch_size * grad_accum = {self.micro_batch_size} * {self.grad_accum} = {rows}: "
                    "every optimizer step must see whole groups")
        return self


class EvalConfig(_Section):
    max_prompts: int = Field(200, ge=1)
    checker: Literal["exact", "final_number"] = Field(
        "exact", description="How the checker judges an answer: `exact` (the completion is exactly the integer: "
                             "the demo), `final_number` (the last integer it states: the arithmetic task, so a "
                             "base model's \"23 + 45 = 68\" counts).")
    max_new_tokens: int = Field(8, ge=1)
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


class GatesConfig(_Section):
    min_reward_gain: float = Field(0.0, description="Candidate mean proxy reward (`rlhf.reward_fns`, what RL "
                                                    "optimised) minus the reference's.")
    min_judge_gain: float = Field(
        0.01, description="Candidate judge score (`eval.judge`: checker accuracy or judge-RM reward) minus the "
                          "reference's. Below it the gate fails whatever the proxy says: reward hacking is a proxy "
                          "that rises while the judge does not.")
    min_win_rate_vs_champion: float = Field(0.5, ge=0.0, le=1.0)
    max_kl: float = Field(5.0, gt=0.0)
    min_accuracy: float = Field(0.0, ge=0.0, le=1.0)


class LabelColumns(_Section):
    """`feedback.annotator: file`: which keys of a label line hold the pair id and the choice. A dotted key reads a
    nested field, so a Label Studio or Argilla export maps on, e.g. `id: data.pair_id`,
    `choice: annotations.0.result.0.value.choices.0`."""

    id: str = Field("pair_id", description="Key of the pair id (as exported in `pairs.jsonl`).")
    choice: str = Field("choice", description="Key of the choice: `a`, `b` or `tie` (case-insensitive).")


class FeedbackConfig(_Section):
    """Continuous RLHF: each round (``round`` >= 1) collects comparisons on the current policy's answers,
    retrains the RM on them with a replay of earlier pairs, and runs RL again from that policy (docs/rounds.md).
    Round 0 is the base pipeline: the feedback stage does nothing."""

    round: int = Field(0, ge=0, description="The round the stages run: 0 the base pipeline, n >= 1 feedback round n "
                                            "(`rlhf run --rounds K` sets it).")
    policy: Literal["champion", "workspace"] = Field(
        "champion", description="Whose answers are compared and where RL continues from: the registry's "
                                "`champion` actor (the flow passes it), or `workspace` (models/actor as it is).")
    annotator: Literal["checker", "file", "rm"] = Field(
        "checker", description="Who labels the pairs: `checker` (the demo's simulated annotator: prefers the "
                               "checker-correct answer), `file` (pairs exported for annotators, labels imported "
                               "from `labels_file`), `rm` (a judge reward model: AI feedback, `judge_model`).")
    label_noise: float = Field(0.0, ge=0.0, lt=0.5, description="`checker`: share of labels flipped at random, "
                                                                "simulating annotator disagreement.")
    prompts_per_round: int = Field(256, ge=1, description="Prompts sampled from prompts.parquet per round.")
    samples_per_prompt: int = Field(4, ge=2, description="Responses sampled per prompt (K); pairs are formed "
                                                         "among the distinct ones.")
    pairs_per_prompt: int = Field(2, ge=1, description="At most this many pairs per prompt, drawn among the "
                                                       "distinct responses.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the responses compared.")
    labels_file: str | None = Field(None, description="`file`: the annotators' labels, JSONL; null: "
                                                      "`data/feedback/round_<n>/labels.jsonl`.")
    label_columns: LabelColumns = Field(default_factory=lambda: LabelColumns())
    judge_model: str | None = Field(None, description="`rm`: the judge RM directory; null: models/judge.")
    replay_share: float = Field(0.1, ge=0.0, le=1.0, description="Share of all earlier pairs (prepared pairs and "
                                                                 "earlier rounds) replayed beside the new ones "
                                                                 "(DeepSeekMath keeps 10 %).")
    rm_init: Literal["previous", "sft"] = Field(
        "previous", description="The RM of a round starts from the previous round's RM or from the SFT model.")
    rm_lr: float | None = Field(1e-4, gt=0.0, description="`rm.lr` in a round (fine-tuning the previous RM wants "
                                                           "a smaller rate than training from SFT); null: `rm.lr`.")
    rl_steps: int | None = Field(None, ge=1, description="`rlhf.num_steps` in a round; null: `rlhf.num_steps`.")
    reference: Literal["sft", "previous"] = Field(
        "sft", description="The KL reference of a round's RL: the SFT model (every round stays near the "
                           "demonstrations; KL accumulates over rounds, gates.max_kl bounds it) or the round's "
                           "starting actor (each round a trust region around the last; drift is unbounded).")


class TrackingConfig(_Section):
    experiment: str | None = Field(None, description="MLflow experiment; defaults to `project.name`.")
    registry_prefix: str | None = Field(None, description="Registered model prefix; defaults to `project.name`.")
    system_metrics: bool = True


class Params(_Section):
    project: ProjectConfig = Field(default_factory=ProjectConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    rlhf: RLHFConfig = Field(default_factory=RLHFConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gates: GatesConfig = Field(default_factory=GatesConfig)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def section_hash(self, *sections: str) -> str:
        """sha256 (first 16 hex) of the named sections, or of everything when none are named."""
        dump = self.model_dump(mode="json")
        if sections:
            dump = {k: dump[k] for k in sections}
        return hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:16]


def for_round(params: Params) -> Params:
    """``params`` as a feedback round (``feedback.round`` >= 1) trains: ``rm.lr`` and ``rlhf.num_steps`` replaced
    by ``feedback.rm_lr`` / ``feedback.rl_steps`` where set; round 0 unchanged."""
    fb = params.feedback
    if not fb.round:
        return params
    update = {}
    if fb.rm_lr is not None:
        update["rm"] = params.rm.model_copy(update={"lr": fb.rm_lr})
    if fb.rl_steps is not None:
        update["rlhf"] = params.rlhf.model_copy(update={"num_steps": fb.rl_steps})
    return params.model_copy(update=update)


# --------------------------------------------------------------------------- loading
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r}: empty key")
    return path, yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set each ``key.path=value`` into a nested dict (creating levels as needed)."""
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {loc}: {msg}")
    return f"invalid configuration in {origin}:\n" + "\n".join(lines)


def validate(raw: dict, origin: str = "<params>") -> Params:
    try:
        return Params.model_validate(raw or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err, origin)) from None


def load_params(path: str | Path = DEFAULT_PARAMS, overrides: list[str] | None = None) -> Params:
    """Read ``path`` (missing file = all defaults), apply ``-S`` overrides, validate."""
    path = Path(path)
    raw: dict = {}
    if path.exists():
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    raw = apply_overrides(raw, list(overrides or []))
    return validate(raw, origin=str(path))
