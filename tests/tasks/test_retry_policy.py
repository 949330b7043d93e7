"""Only transient stage failures are retried: the exit-code contract, the pure decision, and real Prefect retries
of real ``dvc repro`` stages (a bad-input exit fails at once; a crash is retried and then passes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlhf_core.ops.dvc_repro import stage_exit_code
from rlhf_core.stages import exit_codes
from tasks.errors import StageFailed
from tasks.k8s.submit import StageJobFailed, StageJobTimeout
from tasks.retry_policy import transient
from tasks.stages import dvc_repro_stage

REPO = Path(__file__).resolve().parents[2]


class ApiException(Exception):  # the decision reads the class name and ``status``, as on kubernetes' own
    def __init__(self, status: int, reason: str = ""):
        super().__init__(reason)
        self.status, self.reason = status, reason


class TaskRunTimeoutError(TimeoutError):  # named like Prefect's task timeout
    pass


@pytest.mark.parametrize("exc, retry, why", [
    (StageFailed("x", exit_codes.CRASHED), True, "exit 1 (crashed)"),
    (StageFailed("x", -9), True, "killed by signal 9"),
    (StageFailed("x", exit_codes.TRACKING_UNAVAILABLE), True, "MLflow unreachable"),
    (StageFailed("x", None), True, "no exit code"),
    (StageFailed("x", exit_codes.BAD_CONFIG), False, "invalid params"),
    (StageFailed("x", exit_codes.BAD_INPUT), False, "bad input"),
    (StageJobFailed("x", reason="BackoffLimitExceeded", pod_reason="Evicted"), True, "pod Evicted"),
    (StageJobFailed("x", reason="BackoffLimitExceeded", pod_reason="OOMKilled", exit_code=137), True, "signal 9"),
    (StageJobFailed("x", reason="PodFailurePolicy", exit_code=65), False, "bad input"),
    (StageJobFailed("x", reason="DeadlineExceeded"), False, "activeDeadlineSeconds"),
    (StageJobTimeout("x", reason="Timeout"), False, "timeout"),
    (ApiException(503, "Service Unavailable"), True, "503"),
    (ApiException(429, "Too Many Requests"), True, "429"),
    (ApiException(403, "Forbidden"), False, "403 Forbidden"),
    (ApiException(422, "Unprocessable Entity"), False, "422"),
    (ConnectionResetError("reset"), True, "ConnectionResetError"),
    (TimeoutError("read timed out"), True, "TimeoutError"),
    (TaskRunTimeoutError("4 h"), False, "the task's timeout"),
    (ValueError("unknown backend"), False, "bad options"),
])
def test_transient_decision(exc, retry, why):
    decided, reason = transient(exc)
    assert decided is retry and why in reason, reason


def test_permanent_codes_and_their_words():
    assert sorted(exit_codes.PERMANENT) == [2, 65]
    assert [exit_codes.retryable(c) for c in (0, 1, 2, 3, 65, -9, 137, None)] == [True, True, False, True, False,
                                                                                 True, True, True]
    assert exit_codes.describe(137) == "exit 137 (killed by signal 9)" and exit_codes.describe(-15) == \
        "killed by signal 15"


def _dvc_workspace(root: Path, stages: dict[str, str]) -> Path:
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {k: {"cmd": v} for k, v in stages.items()}}))
    return root


def test_dvc_repro_failure_carries_the_stage_exit_code(tmp_path):
    root = _dvc_workspace(tmp_path / "ws", {
        "bad_input": f"{sys.executable} -c \"import sys; print('data/x.jsonl:3: malformed'); sys.exit(65)\"",
        "killed": f"{sys.executable} -c \"import os, signal; os.kill(os.getpid(), signal.SIGKILL)\""})
    lines: list[str] = []
    with pytest.raises(StageFailed, match=r"failed \(exit 65 \(bad input\)\)") as err:
        dvc_repro_stage("bad_input", root, dict(os.environ), False, lines.append)
    assert err.value.exit_code == 65 and "data/x.jsonl:3: malformed" in str(err.value)
    with pytest.raises(StageFailed, match="killed by signal 9") as err:
        dvc_repro_stage("killed", root, dict(os.environ), False, lines.append)
    # DVC reports -9 when its shell execs the command, 137 (128 + 9) when the shell forks it: both say SIGKILL
    assert err.value.exit_code in (-9, 137) and exit_codes.retryable(err.value.exit_code)
    assert stage_exit_code(["ERROR: failed to reproduce 'a': failed to run: rlhf stage a, exited with 2"]) == 2
    assert stage_exit_code(["no such line"]) is None


def test_interrupted_task_stops_the_stage_process_group(tmp_path):
    """A KeyboardInterrupt (as Prefect's cancellation or timeout delivers) while the stage runs: the stage's
    process (a grandchild under DVC) is gone right after, not left training."""
    pid_file = tmp_path / "stage.pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('started', flush=True); " \
             "time.sleep(600)"
    root = _dvc_workspace(tmp_path / "ws", {"slow": f"{sys.executable} -c \"{script}\""})

    def interrupt_when_started(line: str) -> None:
        if line == "started":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dvc_repro_stage("slow", root, dict(os.environ), False, interrupt_when_started)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), f"stage process {pid} outlived the interrupted task"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


@pytest.mark.slow
def test_prefect_retries_a_crash_and_not_bad_input(tmp_path):
    """Real Prefect (embedded server), the real stage task over real ``dvc repro``: a stage that exits 65 runs
    once; a stage that crashes (exit 1) on its first attempt is retried and completes."""
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    count = "import pathlib, sys; d = pathlib.Path({d!r}); n = len(list(d.glob('{s}-*'))); " \
            "(d / f'{s}-{{n}}').touch(); "
    def cmd(stage: str, tail: str) -> str:
        return f'{sys.executable} -c "{count.format(d=str(attempts), s=stage)}{tail}"'

    root = _dvc_workspace(tmp_path / "ws", {"bad_input": cmd("bad_input", "sys.exit(65)"),
                                            "flaky": cmd("flaky", "sys.exit(1 if n == 0 else 0)")})
    script = textwrap.dedent(f"""
        from prefect import flow
        from tasks.stages import run_stage

        @flow
        def two():
            task = run_stage.with_options(retries=2, retry_delay_seconds=0)
            bad = task(\"bad_input\", root={str(root)!r}, return_state=True)
            flaky = task(\"flaky\", root={str(root)!r}, return_state=True)
            return bad.type.value, flaky.type.value

        print(\"STATES\", *two())
    """)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(REPO),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert "STATES FAILED COMPLETED" in out, out[-4000:]
    assert sorted(p.name for p in attempts.iterdir()) == ["bad_input-0", "flaky-0", "flaky-1"]
    assert "not retrying: stage exit 65 (bad input)" in out and "retrying: stage exit 1 (crashed)" in out
