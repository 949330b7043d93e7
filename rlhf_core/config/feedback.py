"""``feedback``: continuous RLHF rounds (docs/rounds.md), and where imported labels keep the pair id and choice."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.config.base import Section


class LabelColumns(Section):
    """`feedback.annotator: file`: which keys of a label line hold the pair id and the choice. A dotted key reads a
    nested field, so a Label Studio or Argilla export maps on, e.g. `id: data.pair_id`,
    `choice: annotations.0.result.0.value.choices.0`."""

    id: str = Field("pair_id", description="Key of the pair id (as exported in `pairs.jsonl`).")
    choice: str = Field("choice", description="Key of the choice: `a`, `b` or `tie` (case-insensitive).")


class FeedbackConfig(Section):
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
