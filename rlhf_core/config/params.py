"""``Params``, every section together (``project`` and ``tracking`` are defined here), and ``for_round``."""

from __future__ import annotations

import hashlib
import json

from pydantic import Field

from rlhf_core.config.base import Section
from rlhf_core.config.data import DataConfig
from rlhf_core.config.evaluation import EvalConfig, GatesConfig
from rlhf_core.config.feedback import FeedbackConfig
from rlhf_core.config.model import ComputeConfig, ModelConfig
from rlhf_core.config.rl import RLHFConfig
from rlhf_core.config.training import RMConfig, SFTConfig


# --------------------------------------------------------------------------- project
class ProjectConfig(Section):
    name: str = Field("rlhf-demo", description="Project name; MLflow experiment and registry prefix default to it.")
    seed: int = Field(1234, ge=0, description="Global seed: data splits, init, sampling.")
    workspace: str = Field(".rlhf", description="Ignored state folder: MLflow DB, DVC remote, Prefect home.")


# --------------------------------------------------------------------------- tracking
class TrackingConfig(Section):
    experiment: str | None = Field(None, description="MLflow experiment; defaults to `project.name`.")
    registry_prefix: str | None = Field(None, description="Registered model prefix; defaults to `project.name`.")
    system_metrics: bool = True


class Params(Section):
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
