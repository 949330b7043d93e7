"""Prefect task: run one pipeline stage.

Local backend: ``dvc repro --single-item STAGE`` in the workspace, so DVC
decides whether the stage is up to date (skipped) and records its outputs.
Kubernetes backend: the stage's Job (``tasks.k8s``), the same
``rlhf stage NAME`` command in the GPU image.  Stage output is streamed into
the Prefect logs line by line.  Only transient failures are retried
(``tasks.retry_policy``), backing off exponentially; a retried training
stage resumes from its checkpoint.  An interrupted task stops what it
started (the local process group; the Kubernetes Job).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff

from rlhf_core.ops.dvc_remote import fetch_state
from rlhf_core.ops.dvc_repro import reports_run, run_repro, stage_env
from rlhf_core.ops.flow_watch import FLOW_PID_ENV
from rlhf_core.ops.paths import METRICS
from rlhf_core.stages import STAGE_TIMEOUT_S, exit_codes
from tasks.errors import StageFailed
from tasks.k8s.submit import submit_stage_job
from tasks.retry_policy import retry_transient


def dvc_repro_stage(stage: str, root: Path, env: dict[str, str], force: bool, echo) -> str:
    """Run ``dvc repro --single-item STAGE`` (``rlhf_core.ops.dvc_repro``); returns ``"ran"`` or ``"skipped"``;
    raises :class:`StageFailed` with the stage's exit code.

    DVC and the stage run in their own process group: when this call is interrupted (task timeout, flow
    cancellation, Ctrl-C) the group gets SIGTERM, then SIGKILL after ``STOP_GRACE_S``, so no stage process
    outlives the task that started it. Should this process itself be killed outright, the stage notices and
    stops at its next step boundary with a checkpoint (``rlhf_core.ops.flow_watch``).
    """
    env = {**env, FLOW_PID_ENV: str(os.getpid())}  # the stage stops if this process dies (rlhf_core.ops.flow_watch)
    outcome = run_repro(stage, root, env, echo, force=force)
    if outcome.returncode != 0:
        code = outcome.stage_code
        raise StageFailed(f"stage {stage!r} failed ({exit_codes.describe(code)}):\n" + "\n".join(outcome.tail), code)
    return outcome.status


def kubernetes_stage(stage: str, root: Path, env: dict[str, str] | None, k8s: dict, echo) -> str:
    """The stage's Job; returns ``"ran"`` or ``"skipped"``. Under a DVC remote (``k8s["dvc_remote"]``) the pod
    says which (DVC's lines stream through ``echo``), and the state's files (``dvc.lock``, metrics, reports) are
    then fetched into ``root``; without one the stage always runs."""
    seen: list[bool] = []

    def log(line: str) -> None:
        echo(line)
        if reports_run(stage, line):
            seen.append(True)

    settings = dict(k8s)
    merged = {**(settings.pop("env", None) or {}), **(env or {})}  # the user's env, the flow's own keys over it
    submit_stage_job(stage, env=merged or None, log=log, **settings)
    remote = k8s.get("dvc_remote")
    if not remote:
        return "ran"
    fetched = fetch_state(root, remote)
    echo(f"fetched {', '.join(fetched) or 'nothing'} from {remote}")
    return "ran" if seen else "skipped"


def read_stage_metrics(stage: str, root: Path) -> dict:
    path = root / METRICS / f"{stage}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@task(name="stage", task_run_name="stage-{stage}", retries=2, retry_delay_seconds=exponential_backoff(10),
      retry_jitter_factor=0.2, retry_condition_fn=retry_transient, timeout_seconds=STAGE_TIMEOUT_S["local"])
def run_stage(stage: str, root: str = ".", backend: str = "local", env: dict[str, str] | None = None,
              force: bool = False, k8s: dict | None = None) -> dict:
    """Run ``stage`` on ``backend``; returns ``{"stage", "status": ran|skipped, "seconds", "metrics"}``."""
    logger = get_run_logger()
    start = time.monotonic()
    root_path = Path(root)
    if backend == "local":
        status = dvc_repro_stage(stage, root_path, stage_env(env), force, logger.info)
    elif backend == "kubernetes":
        status = kubernetes_stage(stage, root_path, env, k8s or {}, logger.info)
    else:
        raise ValueError(f"unknown backend {backend!r}; expected local or kubernetes")
    seconds = round(time.monotonic() - start, 1)
    logger.info("stage %s %s in %.1fs", stage, status, seconds)
    return {"stage": stage, "status": status, "seconds": seconds, "metrics": read_stage_metrics(stage, root_path)}
