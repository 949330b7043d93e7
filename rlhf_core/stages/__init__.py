"""The pipeline's stages, in order: the one list every caller (CLI, flow, Kubernetes Jobs) reads.

Each entry maps ``rlhf stage NAME`` to the ``module:function`` taking ``(params, root, log)``: the data and
evaluation stages live here, the training stages in ``rlhf_core.trainers``;
``dvc.yaml`` declares the same stages with their deps and outs (``tests/tasks/test_dvc_pipeline.py`` checks
the two agree).
"""

from __future__ import annotations

from collections.abc import Callable

STAGES: dict[str, str] = {
    "prepare": "rlhf_core.stages.prepare:run",
    "sft": "rlhf_core.trainers.sft:train_sft",
    "feedback": "rlhf_core.stages.feedback:run",
    "rm": "rlhf_core.trainers.rm:train_rm",
    "rlhf": "rlhf_core.trainers.rlhf.trainer:train_rlhf",
    "evaluate": "rlhf_core.stages.evaluate:run",
}
STAGE_NAMES: tuple[str, ...] = tuple(STAGES)
# stages with nothing to do under these params, which open no MLflow run (they still write their metrics file):
# feedback's round 0, the base pipeline, collects no comparisons (an MLflow run costs a stage ~5 s of start-up)
IDLE: dict[str, Callable] = {"feedback": lambda params: params.feedback.round == 0}
# stages that checkpoint: a SIGTERM makes them save and exit 75 (``rlhf_core.engine.stop``)
CHECKPOINTED_STAGES: tuple[str, ...] = ("sft", "rm", "rlhf")

# wall-clock bound of one stage attempt, per backend (a GPU Job may train for days)
STAGE_TIMEOUT_S: dict[str, int] = {"local": 4 * 3600, "kubernetes": 72 * 3600}
