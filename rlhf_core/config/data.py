"""``data``: where the rows come from (the demo and arithmetic generators, local files, Hugging Face datasets),
how they are split over the phases, and the token limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.config.base import Section


class DemoDataConfig(Section):
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


class ArithmeticDataConfig(Section):
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
    answer_style: Literal["result", "worked"] = Field(
        "result", description="The demonstrations' answer: `result`, the bare result (`68`); `worked`, the second "
                              "operand's tens then its ones, one step each, the result last (`23 + 40 = 63, "
                              "63 + 5 = 68`: up to 24 tokens before the EOS, so raise `data.max_response_len`, "
                              "`rlhf.max_new_tokens` and `eval.max_new_tokens`). The checker reads the last "
                              "integer either way; rejected answers end in a wrong one.")
    base_negatives: int = Field(
        256, ge=0, description="Preference pairs whose rejected answer is the base model's own sampled wrong "
                               "answer (its final number in the answer style), sampled in prepare; the other "
                               "pairs reject a near miss. 0: near misses only (no sampling).")
    base_max_new_tokens: int = Field(24, ge=1, description="Tokens the base model may write per sampled answer.")


class MultistepDataConfig(Section):
    """`data.source: multistep`: chains of sums and differences solved one operation per line, the task of process
    supervision (`rlhf_core/rewards/multistep.py`; docs/data-card-multistep.md)."""

    n_train: int = Field(4000, ge=10, description="Training rows (questions whose operand tuple and phrasing are "
                                                  "not held out), split over SFT / RM / RL by `data_split`.")
    n_held_out: int = Field(400, ge=3, description="Held-out rows, split over the phases' eval files the same way.")
    min_ops: int = Field(2, ge=1, le=8, description="Fewest operations (steps) a question asks for.")
    max_ops: int = Field(4, ge=1, le=8, description="Most operations (steps) a question asks for.")
    max_operand: int = Field(30, ge=1, le=10_000, description="Start value and operands from [0, max_operand].")
    held_out_share: float = Field(0.15, ge=0.0, lt=1.0, description="Share of operand tuples held out.")
    held_out_phrasings: int = Field(1, ge=0, description="Phrasings held out (the last ones listed).")

    @model_validator(mode="after")
    def _ops_range(self) -> MultistepDataConfig:
        if self.min_ops > self.max_ops:
            raise ValueError(f"min_ops {self.min_ops} is above max_ops {self.max_ops}")
        return self


class ColumnMap(Section):
    prompt: str = Field("prompt", description="Source column holding the prompt.")
    response: str = Field("response", description="Source column holding the SFT response.")
    chosen: str = Field("chosen", description="Source column holding the preferred response.")
    rejected: str = Field("rejected", description="Source column holding the dispreferred response.")
    messages: str = Field("messages", description="Source column holding a chat `messages` list.")
    conversations: str = Field("conversations", description="Source column holding a ShareGPT `conversations` list "
                                                            "(`from`: system / human / gpt, `value`): read as "
                                                            "`messages`.")
    answer: str = Field("answer", description="Source column holding a ground-truth answer (optional).")


class SourceConfig(Section):
    """One data source: a file (local or an object-store URL) or a Hugging Face dataset."""

    path: str | None = Field(None, description="JSONL/JSON/Parquet/CSV file: a local path or an fsspec URL "
                                                "(s3://, gs://, hf://); read a line or a row group at a time.")
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


class PhaseFiles(Section):
    sft: SourceConfig | None = None
    pairs: SourceConfig | None = None
    prompts: SourceConfig | None = None


class DataConfig(Section):
    source: Literal["demo", "arithmetic", "multistep", "mixed", "per_phase"] = Field(
        "demo", description="`demo`: built-in generator for the tiny model; `arithmetic`: real-text arithmetic "
                            "for a pretrained chat model (`data.arithmetic`, its held-out split); `multistep`: "
                            "chains solved one step per line (`data.multistep`, its held-out split); `mixed`: "
                            "`sources` split by `data_split`; `per_phase`: explicit `files` for each phase.")
    demo: DemoDataConfig = Field(default_factory=DemoDataConfig)
    arithmetic: ArithmeticDataConfig = Field(default_factory=ArithmeticDataConfig)
    multistep: MultistepDataConfig = Field(default_factory=MultistepDataConfig)
    sources: list[SourceConfig] = Field(default_factory=list, description="Sources for `source: mixed`.")
    files: PhaseFiles = Field(default_factory=PhaseFiles, description="Sources for `source: per_phase`.")
    columns: ColumnMap = Field(default_factory=ColumnMap)
    data_split: list[float] = Field(default_factory=lambda: [2.0, 4.0, 4.0], min_length=3, max_length=3,
                                    description="DeepSpeed-Chat shares for SFT / RM / RL (normalised).")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out share of every phase.")
    max_prompt_len: int = Field(48, ge=1, description="Prompt token limit (the text's tokens; a BOS that the "
                                                      "tokenizer adds comes on top).")
    max_response_len: int = Field(16, ge=1, description="Response token limit (longer rows are dropped).")
    truncation: Literal["auto", "left", "drop"] = Field(
        "auto", description="Over-long prompts: keep their last tokens (`left`) or drop the row (counted); "
                            "`auto`: drop where a chat template rendered them (cutting one would cut its "
                            "head off: `left` is then an error), else `left`.")
    on_malformed: Literal["error", "drop"] = Field(
        "error", description="Malformed lines (bad JSON, non-UTF-8): fail naming file:line, or drop and count.")
    dedupe: bool = Field(True, description="Drop exact duplicate rows within a phase (counted).")

    @field_validator("data_split")
    @classmethod
    def _split_positive(cls, v: list[float]) -> list[float]:
        if any(x < 0 for x in v) or sum(v) <= 0:
            raise ValueError("shares must be >= 0 with a positive sum")
        return v
