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
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff

from rlhf_core.flow_watch import FLOW_PID_ENV
from rlhf_core.paths import METRICS
from rlhf_core.stages import STAGE_TIMEOUT_S, exit_codes
from tasks.errors import StageFailed
from tasks.k8s.submit import submit_stage_job
from tasks.retry_policy import retry_transient

SKIP_MARKER = "didn't change, skipping"
DVC_EXIT = re.compile(r"failed to run: .*, exited with (-?\d+)")
STOP_GRACE_S = 30.0  # an interrupted task gives its stage process this long to exit after SIGTERM


def stage_exit_code(lines: list[str]) -> int | None:
    """The stage command's exit code from DVC's ``failed to run: CMD, exited with N`` line (DVC itself exits 255)."""
    for line in reversed(lines):
        found = DVC_EXIT.search(line)
        if found:
            return int(found.group(1))
    return None


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with this interpreter's bin dir first on PATH (so ``rlhf`` resolves)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def dvc_repro_stage(stage: str, root: Path, env: dict[str, str], force: bool, echo) -> str:
    """Run ``dvc repro --single-item STAGE``; returns ``"ran"`` or ``"skipped"``; raises :class:`StageFailed`.

    DVC and the stage run in their own process group: when this call is interrupted (task timeout, flow
    cancellation, Ctrl-C) the group gets SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`, so no stage process
    outlives the task that started it. Should this process itself be killed outright, the stage notices and
    stops at its next step boundary with a checkpoint (``rlhf_core.flow_watch``).
    """
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage] + (["--force"] if force else [])
    env = {**env, FLOW_PID_ENV: str(os.getpid())}  # the stage stops if this process dies (rlhf_core.flow_watch)
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    tail: list[str] = []
    skipped = False
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            echo(line)
            skipped |= SKIP_MARKER in line
            tail = (tail + [line])[-20:]
        proc.wait()
    finally:
        if proc.poll() is None:
            stop_process_group(proc, echo)
    if proc.returncode != 0:
        code = stage_exit_code(tail)
        raise StageFailed(f"stage {stage!r} failed ({exit_codes.describe(code)}):\n" + "\n".join(tail), code)
    return "skipped" if skipped else "ran"


def stop_process_group(proc: subprocess.Popen, echo) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after :data:`STOP_GRACE_S`."""
    echo(f"stopping stage process group {proc.pid} (SIGTERM, SIGKILL after {STOP_GRACE_S:.0f}s)")
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


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
        submit_stage_job(stage, env=env, log=logger.info, **(k8s or {}))
        status = "ran"
    else:
        raise ValueError(f"unknown backend {backend!r}; expected local or kubernetes")
    seconds = round(time.monotonic() - start, 1)
    logger.info("stage %s %s in %.1fs", stage, status, seconds)
    return {"stage": stage, "status": status, "seconds": seconds, "metrics": read_stage_metrics(stage, root_path)}
