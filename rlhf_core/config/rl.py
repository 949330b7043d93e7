"""``rlhf``: PPO (``rlhf.ppo``) and GRPO (``rlhf.grpo``), the rollouts, the KL, the rewards."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section
from rlhf_core.config.training import OptimConfig


class PPOConfig(Section):
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
    critic_warmup_iterations: int = Field(
        0, ge=0, description="The first N rollout iterations (of `num_steps`) train only the critic: the actor "
                             "samples and its loss is computed for the metrics (`actor_frozen`: 1), but it takes "
                             "no optimizer step, no ptx loss and no EMA update (OpenRLHF's "
                             "`--freezing_actor_steps`). A critic initialised from the RM starts with a head "
                             "fitted to scores, not returns; warm-up lets it fit the values before its "
                             "advantages move the actor. Needs `advantage_estimator: gae` (a critic).")
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
    supervision: Literal["outcome", "process"] = Field(
        "outcome", description="`outcome`: the score at each response's last token. `process`: a process reward "
                               "model (`rm.objective: process`, the only reward source) scores every step's end "
                               "(`rm.step_delimiter`); the step rewards of a prompt's samples are normalised "
                               "together, as `grpo.supervision: process` does, and each sits on its step's last "
                               "token beside the per-token KL penalty (`algos.process.step_token_rewards`); GAE "
                               "over them (needs `advantage_estimator: gae`). Responses with an empty step are "
                               "dropped, counted as `empty_step_dropped`.")


class GRPOConfig(Section):
    group_size: int = Field(4, ge=2, description="G: responses sampled per prompt; advantages are group-relative.")
    beta: float = Field(0.04, ge=0.0, description="Coefficient of the KL (to the reference) term in the loss.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator in the loss (DeepSeekMath: k3).")
    clip_eps: float = Field(0.2, gt=0.0, description="Ratio clip of the GRPO surrogate.")
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO: centre only).")
    advantage: Literal["normalised", "best"] = Field(
        "normalised", description="`normalised`: GRPO's group-relative score (`scale`). `best`: RAFT (reward-ranked "
                                  "fine-tuning, online): each group's highest-scored response gets advantage 1, "
                                  "the others leave the buffer before the reference pass and training, counted "
                                  "as `unselected_dropped`; the loss is then the NLL of the reward's pick among "
                                  "the policy's own samples (+ the KL term). It uses only the reward's ranking "
                                  "within a group, never its scale. Outcome supervision only.")
    supervision: Literal["outcome", "process"] = Field(
        "outcome", description="`outcome`: one score per response, every token's advantage the group-normalised "
                               "score. `process` (DeepSeekMath 4.1.3): a process reward model (`rm.objective: "
                               "process`, the only reward source) scores every step's end (`rm.step_delimiter`); "
                               "the step rewards of a group's G responses are normalised together and a token's "
                               "advantage is the sum of those of its step and every later one "
                               "(`algos.process.process_advantages`). Responses with an empty step are dropped, "
                               "counted as `empty_step_dropped`.")
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
    forward_batch_size: int = Field(
        0, ge=0, description="Rows per inference pass after the rollout (the reference's and the actor's "
                             "log-probs, the critic's values); 0: `micro_batch_size`, the rows a training pass "
                             "holds, so no pass needs more memory than training does.")
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
    rollout_engine: Literal["auto", "generate", "static"] = Field(
        "auto", description="What samples the rollouts: `generate` (transformers' `generate`, a growing KV cache), "
                            "`static` (`rlhf_core/passes/static_decode.py`: a preallocated KV cache and a "
                            "fixed-shape decode step, captured once in a CUDA graph on a GPU; the same tokens "
                            "for the same seed), `auto` (`static` on a GPU, `generate` on the CPU). `static` "
                            "needs a model whose every layer is full SDPA attention and falls back to "
                            "`generate` otherwise, and under ZeRO-3 over several processes.")
    rollout_compile: bool = Field(
        True, description="With the `static` engine on a GPU, compile the model's decode forward "
                          "(`torch.compile`, inductor) before the step is captured: fused elementwise kernels, "
                          "the queries grouped over a GQA model's KV heads (passes/grouped_attention.py). The "
                          "first rollout of a run pays the compile (tens of seconds); a compile that fails falls "
                          "back to the eager step, said once. The sampling stays eager: the same tokens for a "
                          "seed up to float rounding. No effect on a CPU (docs/results/benchmarks-gpu-rollout.md).")
    rollout_attention: Literal["sdpa", "product"] = Field(
        "sdpa", description="With `rollout_compile`, the compiled step's attention for the decode token: `sdpa` "
                            "(the queries grouped over the KV heads, one SDPA call) or `product` (the same "
                            "grouping written out as two matrix products and a float32 softmax, which read the "
                            "KV cache once each; passes/grouped_attention.py). The same tokens for a seed up to "
                            "float rounding. `product` is a candidate for the GPU decode step, not yet measured "
                            "there (docs/results/benchmarks-gpu-rollout.md).")
    rollout_free_finished: bool = Field(
        True, description="With the `static` engine, rows that have finished leave the batch: when the live rows "
                          "fit in half of it they move to a decoder of the power of two that holds them (at least "
                          "8 rows), so later steps cost only those. The same tokens for a seed (each row keeps "
                          "its own random draws). Each new batch size is one more CUDA graph capture, and with "
                          "`rollout_compile` one more compile the first time it is met.")
    shared_prefix: bool = Field(
        True, description="Forward each prompt once for its group of samples (GRPO's G, PPO's "
                          "`samples_per_prompt`) in the log-prob passes, the critic's value pass and the actor's "
                          "and critic's training forward: the prompt's KV cache is shared by the group's "
                          "responses (same logits, values and gradients up to float rounding, fewer FLOPs; "
                          "docs/rlhf.md). Under `compute.gradient_checkpointing` the training forwards pack the "
                          "groups (`pack_groups`) or run whole rows: a re-run layer cannot share a cache. RM "
                          "scoring always computes a shared prompt once (inference only).")
    pack_groups: bool = Field(
        True, description="With `shared_prefix`, the actor's and reference's log-prob passes and the actor's "
                          "training forward pack each group's responses after its prompt in one row under a "
                          "block-causal mask (`rlhf_core/passes/group_packing.py`: no padding between responses, one "
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
        if self.algorithm == "ppo" and self.ppo.supervision == "process" and self.ppo.advantage_estimator != "gae":
            raise ValueError("ppo.supervision: process places the step rewards on their tokens for GAE: it needs "
                             f"ppo.advantage_estimator: gae (got {self.ppo.advantage_estimator})")
        if self.algorithm == "ppo" and self.ppo.critic_warmup_iterations:
            if self.ppo.advantage_estimator != "gae":
                raise ValueError("ppo.critic_warmup_iterations trains the critic alone: it needs "
                                 f"ppo.advantage_estimator: gae (got {self.ppo.advantage_estimator})")
            if self.ppo.critic_warmup_iterations >= self.num_steps:
                raise ValueError(f"ppo.critic_warmup_iterations {self.ppo.critic_warmup_iterations} leaves no "
                                 f"iteration of num_steps {self.num_steps} to train the actor")
        if self.algorithm == "ppo" and self.ppo.advantage_estimator == "rloo" and self.ppo.samples_per_prompt < 2:
            raise ValueError("ppo.advantage_estimator: rloo needs ppo.samples_per_prompt >= 2 "
                             f"(got {self.ppo.samples_per_prompt})")
        if self.algorithm == "grpo" and self.grpo.advantage == "best" and self.grpo.supervision == "process":
            raise ValueError("grpo.advantage: best picks one response per group by its outcome score: it needs "
                             "grpo.supervision: outcome (got process)")
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
