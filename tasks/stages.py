"""Prefect task: run one pipeline stage.

Local backend: ``dvc repro --single-item STAGE`` in the workspace, so DVC
decides whether the stage is up to date (skipped) and records its outputs.
Kubernetes backend: the stage's Job (``tasks.k8s``), the same
``rlhf stage NAME`` command in the GPU image.  Stage output is streamed into
the Prefect logs line by line.  Retries back off exponentially; a retried
training stage resumes from its checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff

from rlhf_core.paths import METRICS
from rlhf_core.stages import STAGE_TIMEOUT_S

SKIP_MARKER = "didn't change, skipping"


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries its last output lines."""


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with this interpreter's bin dir first on PATH (so ``rlhf`` resolves)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def dvc_repro_stage(stage: str, root: Path, env: dict[str, str], force: bool, echo) -> str:
    """Run ``dvc repro --single-item STAGE``; returns ``"ran"`` or ``"skipped"``; raises :class:`StageFailed`."""
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage] + (["--force"] if force else [])
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    tail: list[str] = []
    skipped = False
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if not line:
            continue
        echo(line)
        skipped |= SKIP_MARKER in line
        tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise StageFailed(f"stage {stage!r} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return "skipped" if skipped else "ran"


def read_stage_metrics(stage: str, root: Path) -> dict:
    import json

    path = root / METRICS / f"{stage}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@task(name="stage", task_run_name="stage-{stage}", retries=2, retry_delay_seconds=exponential_backoff(10),
      retry_jitter_factor=0.2, timeout_seconds=STAGE_TIMEOUT_S["local"])
def run_stage(stage: str, root: str = ".", backend: str = "local", env: dict[str, str] | None = None,
              force: bool = False, k8s: dict | None = None) -> dict:
    """Run ``stage`` on ``backend``; returns ``{"stage", "status": ran|skipped, "seconds", "metrics"}``."""
    logger = get_run_logger()
    start = time.monotonic()
    root_path = Path(root)
    if backend == "local":
        status = dvc_repro_stage(stage, root_path, stage_env(env), force, logger.info)
    elif backend == "kubernetes":
        from tasks.k8s.submit import submit_stage_job

        submit_stage_job(stage, env=env, log=logger.info, **(k8s or {}))
        status = "ran"
    else:
        raise ValueError(f"unknown backend {backend!r}; expected local or kubernetes")
    seconds = round(time.monotonic() - start, 1)
    logger.info("stage %s %s in %.1fs", stage, status, seconds)
    return {"stage": stage, "status": status, "seconds": seconds, "metrics": read_stage_metrics(stage, root_path)}
