"""``model`` (the base model and its tokenizer, or the tiny demo model) and ``compute`` (DeepSpeed ZeRO, precision,
LoRA, threads, the stop grace)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.config.base import Section


# --------------------------------------------------------------------------- model
class TinyModelConfig(Section):
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


class ModelConfig(Section):
    name_or_path: str | None = Field(
        None, description="The base model, imported by prepare into `models/base`: a Hub id, a local HF folder, "
                          "a `.gguf` file, or `pkg:<package>[/<file>.gguf]` (a GGUF an installed package ships); "
                          "null builds the tiny demo model offline.")
    tokenizer: str | None = Field(None, description="Tokenizer id or path (same forms); defaults to `name_or_path`.")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub (off by default).")
    chat_template: str = Field(
        "auto", description="How prepare renders the prompts of your own files (`data.source: mixed | per_phase`), "
                            "the same for every phase: `auto` with the tokenizer's chat template when it has one, "
                            "else as raw text; `tokenizer` the tokenizer's (an error when it has none); `none` raw "
                            "text (chat rows as `Human: ... Assistant:`); or a `.jinja` file (relative to the "
                            "workspace). A plain prompt is one user turn, an HH transcript its turns; the "
                            "generation prompt is appended. The built-in tasks render their own.")

    @field_validator("chat_template", mode="before")
    @classmethod
    def _from_bool(cls, value):  # the boolean this key took before: false = none, true = tokenizer
        return {False: "none", True: "tokenizer"}.get(value, value) if isinstance(value, bool) else value


# --------------------------------------------------------------------------- compute
class LoraConfig(Section):
    enabled: bool = Field(False, description="Train LoRA adapters (peft) on the policy / RM backbone.")
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1, description="Module names that get adapters.")
    only_optimize_lora: bool = Field(True, description="Freeze everything but the adapters (and a value head).")
    merge_on_save: bool = Field(True, description="Merge adapters into the weights when saving the final model.")


class ComputeConfig(Section):
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    offload: Literal["none", "cpu"] = Field(
        "none", description="ZeRO offload target: optimizer state (stage >= 1) and parameters (stage 3).")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="`auto`: bf16 on GPUs that support it, fp32 on CPU.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in backward (non-reentrant): about one more "
                           "forward per training pass for the activation memory of a layer instead of all. RL's "
                           "training forwards then pack groups or run whole rows, never a shared prompt cache.")
    lean_rmsnorm: bool = Field(
        True, description="Training forwards run a Llama-style RMSNorm that keeps its input and one float per row "
                          "for backward, instead of a float32 copy of its input and the normalised input "
                          "(`rlhf_core/models/lean_norm.py`: the same output, gradients equal up to float "
                          "rounding; other norms keep their own forward).")
    bf16_master: bool = Field(
        False, description="With bf16 precision, keep DeepSpeed's master weights, gradients and Adam moments in "
                           "bf16 too (`bf16_master_weights_and_grads` + `bf16_optimizer_states`), as a trainer of "
                           "bf16 weights does (TRL with a bf16 model): 8 bytes per parameter less than fp32 master "
                           "weights and moments, at the cost of updates smaller than bf16's resolution. Needs "
                           "`zero_stage` >= 1; no effect in fp32 (the CPU).")
    grad_clip: float = Field(1.0, gt=0.0)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    num_threads: int = Field(0, ge=0, description="torch CPU threads; 0: the usable cores (affinity, capped by the "
                                                  "cgroup's CPU quota) split over local processes.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    stop_grace_s: float = Field(
        600.0, gt=0.0, description="After SIGTERM a training stage checkpoints at the next step boundary and "
                                   "exits 75; with no boundary within this many seconds it exits 143 (the previous "
                                   "checkpoint stands). Keep the pod's terminationGracePeriodSeconds above it.")

    @model_validator(mode="after")
    def _bf16_master_needs_zero(self) -> ComputeConfig:
        if self.bf16_master and self.zero_stage == 0:
            raise ValueError("bf16_master needs zero_stage >= 1: DeepSpeed keeps bf16 master weights only in its "
                             "ZeRO optimizer (zero_stage: 1 costs nothing on one process)")
        return self
